"""Adapters to real engines' extension points (transformers' ``generate()`` in
:mod:`.transformers`, vLLM's custom proposer in :mod:`.vllm`). Each private hook of
another library lives in one module here."""
