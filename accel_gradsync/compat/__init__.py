"""Shims for what torch, accelerate and transformers do wrong or not yet (each module says what and
why): FSDP on CPU (`cpu`), exit-time teardown (`teardown`), FSDP1's sharded optimizer reload
(`optimizer_state`) and the tested torch release (`versions`). Imports only `config`."""
