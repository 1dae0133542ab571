"""Test engines: small programs that run a real llama.cpp engine (started by path by the tests)."""
