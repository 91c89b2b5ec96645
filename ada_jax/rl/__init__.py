"""The RL algorithm: sampling controller, advantages, loss, train step, warm start."""
