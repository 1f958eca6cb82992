"""The engine: the Rust scheduler, the model runner and the sampler, stepped together."""
