"""The answer grader and the verifier process pool that runs it."""
