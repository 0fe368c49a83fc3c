"""How the GPT is distributed: FSDP2 (``fully_shard``) per block then the root, optional activation
checkpointing. Kept apart from the model (torchtitan's model.py / parallelize.py split)."""

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from vlm_assets.models.gpt import GPT


def apply_activation_checkpointing(model: GPT) -> None:
    """Recompute each block's activations in backward instead of keeping them (memory for compute)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp2(model: GPT, mesh, *, bf16: bool) -> None:
    """Shard every block, then the root (embeddings, final norm, tied head) over the data-parallel mesh.

    Each block is its own all-gather/reduce-scatter unit, so communication of block i+1 overlaps the
    compute of block i. On GPU parameters are all-gathered in bf16 and gradients reduced in fp32.
    """
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        # The last block's parameters are needed again at once by the root's backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=block is not model.blocks[-1])
    fully_shard(model, mesh=mesh, mp_policy=mp)
