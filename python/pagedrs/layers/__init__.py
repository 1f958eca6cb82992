"""Building blocks of pagedrs's model code, written for the paged cache and aware of a
tensor-parallel shard (rank, world size) so tensor parallelism fits without a rewrite."""
