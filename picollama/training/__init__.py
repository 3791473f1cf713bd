"""The parts train.py leans on: data and batches, optimizers and schedules, the time budget.
Also parallelism, checkpoints and resume, and metrics. Only train.py and the lab's training
benchmarks use them."""
