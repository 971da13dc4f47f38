"""The mixture-of-experts decoder (Qwen2-MoE / Mixtral): `MoEConfig` (stp.shapes.moe),
its parameters (init), routing maths (routing), the routed MLP unit (units),
stages (stage), the one-process reference (reference) and the family (family);
with expert parallelism the token exchanges (dispatch), the layer's MLP cut at them
(ep_units) and the thread that launches them (comm_thread)."""
