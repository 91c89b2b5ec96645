"""Maths prompt sets, prompt building and iteration, the arithmetic task."""
