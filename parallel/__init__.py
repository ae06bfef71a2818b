"""torch.distributed code (imported as longctx.parallel): process mesh, ring attention,
tensor-parallel sharding, sequence-parallel decode. Models hold no parallel logic; this package
applies it to them."""

from longctx.parallel.process_group import init_from_env
from longctx.parallel.ring import ring_attention, shard_sequence, unshard_sequence

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "init_from_env"]
