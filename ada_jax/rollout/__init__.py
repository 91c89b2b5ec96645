"""Generation: the chunked sampler and the RL step's draw callable and batch."""
