"""The real-model context study: how far a trained model reads past its context, by length and
length method, in cells that each save as they finish. It spans sessions: a rerun skips the cells
already saved. The toy-model study (generate.py extrapolate|study) stays in picollama/lab/."""
