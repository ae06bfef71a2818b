"""torch.distributed code (imported as longctx.parallel): process mesh, ring attention,
tensor-parallel sharding, sequence-parallel decode. Models hold no parallel logic; this package
applies it to them."""
