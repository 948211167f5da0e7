"""The model worker: model definition, weight loading, the step runner (ModelRunner) and sampling.

Import the modules directly (actors.worker.model_runner, ...): this package imports nothing, so
light users (the sampler, messages) never pay for torch model code they do not use.
"""
