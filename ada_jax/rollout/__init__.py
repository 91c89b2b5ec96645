"""Generation: the slot-pool rollout engine and the RL step's draw callable and batch."""
