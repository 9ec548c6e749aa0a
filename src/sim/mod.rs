//! vLLM fleet simulator (being written).
