"""Scripts the tests run as files under torchrun (``python -m torch.distributed.run ... FILE``),
one process per rank: `ranked_step` (the learner at any world size), `megatron_stream` (the
megatron backend's refit stream) and `megatron_moe_ep` (a tiny MoE at any expert-parallel size)."""
