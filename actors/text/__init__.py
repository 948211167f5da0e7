"""Text at the engine's edges: the model's tokenizer (`tokenizer`), incremental detokenization and stop
strings (`detokenizer`), one sample's output as a front end sees it (`sample_output`, the gateway's and the
offline LLM's), and what a structured output's grammar means (`grammar`).

Import the modules directly; this package imports nothing.
"""
