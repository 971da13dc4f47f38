"""What `stp simulate` and `stp memory` print a person: times with their unit, a layer
count that matches the partition, parameters and durations in human units, and the
memory line set against this machine when no --hardware is given."""

from __future__ import annotations

import json

import pytest

from stp.cli.main import main
from stp.cli.memory import format_count, format_ms
from stp.train.run.memory_check import available_host_bytes


def _out(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_simulate_says_the_unit_of_its_times(capsys) -> None:
    uniform = _out(capsys, "simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4")
    assert "makespan 15 cost units" in uniform and "times in cost units" in uniform
    model = _out(capsys, "simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--model",
                 "qwen2-12.1b", "--partition", "10,10,10,8")
    assert " ms  bubble_rate" in model


def test_simulate_names_the_partitions_layers_not_the_chunk_default(capsys) -> None:
    """`layers/chunk=1` was printed where the partition gave stages 8-10 layers."""
    out = _out(capsys, "simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--model",
               "qwen2-12.1b", "--partition", "10,10,10,8")
    first = out.splitlines()[0]
    assert "layers/stage=8-10" in first and "layers/chunk" not in first


@pytest.mark.parametrize(("n", "text"), [(140_000, "140k"), (504_000_000, "504M"),
                                         (12.1e9, "12.1B"), (405e9, "405B"), (12, "12")])
def test_parameter_counts_in_human_units(n, text) -> None:
    assert format_count(n) == text


@pytest.mark.parametrize(("ms", "text"), [(0.1905, "0.1905 ms"), (699.6, "699.6 ms"),
                                          (42_390, "42.39 s"), (750_000, "12.5 min")])
def test_durations_in_human_units(ms, text) -> None:
    assert format_ms(ms) == text


def test_memory_without_hardware_is_set_against_this_machine(capsys) -> None:
    out = _out(capsys, "memory")
    assert "this machine's" in out and "a100-80g" not in out
    assert "e+" not in out and "0.00014B" not in out
    got = json.loads(_out(capsys, "memory", "--json"))
    if "CUDA" not in got["device_memory_of"] and "RAM" in got["device_memory_of"]:
        host = available_host_bytes()
        assert host is not None and abs(got["device_memory"] - host) < 0.2 * host
    named = _out(capsys, "memory", "--hardware", "h100-80g")
    assert "device memory (h100-80g): 79.65 GiB" in named  # the preset's 85.5e9 bytes
