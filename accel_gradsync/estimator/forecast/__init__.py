"""`auto`'s step-1 forecast in a live run: `live` (`LiveForecaster`: what it reads of a bound
model, the child it starts on the main process, the broadcast of its answer) and `forecast_child`
(the child process: the estimate's whole-step simulation, in a fake process group of its own).
Imports the estimate's modules, never the reverse."""
