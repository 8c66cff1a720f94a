"""Adapters to real engines' extension points (transformers' ``generate()``, vLLM's
custom proposer). Each private hook of another library lives in one module here."""
