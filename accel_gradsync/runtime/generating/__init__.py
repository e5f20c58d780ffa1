"""Forwards without gradients (generation, log-prob passes, evaluation): `generation`
(`GenerationGather`: what they gather, `gather_for_generation`, `gathered()`), `token_sync`
(transformers' per-token sync turned off for a model proven free of its own collectives) and
`draw_replay` (the random draws a rank done first is short afterwards, replayed).
Imports `wrappers`, `core`."""
