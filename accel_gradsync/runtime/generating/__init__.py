"""Forwards without gradients (generation, log-prob passes, evaluation): `generation`
(`GenerationGather`: what they gather, `gather_for_generation`, `gathered()`) and `token_sync`
(transformers' per-token sync turned off for a model proven free of its own collectives).
Imports `wrappers`, `core`."""
