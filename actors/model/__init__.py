"""The model as the engine knows it before any weight is loaded: its config (`config`), the few numbers
that size its memory (`shape`), what its values take in bytes (`value_bytes`), the memory plan built from
them (`memory_plan`), where its files are (`source`, `hub`) and the GGUF header reader (`gguf_file`).

Import the modules directly; this package imports nothing (none of it needs torch).
"""
