"""The decoder, its weights and sharding, and tokenizers."""
