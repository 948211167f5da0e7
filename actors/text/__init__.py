"""Text at the engine's edges: the model's tokenizer (`tokenizer`), incremental detokenization and stop
strings (`detokenizer`), and what a structured output's grammar means (`grammar`).

Import the modules directly; this package imports nothing.
"""
