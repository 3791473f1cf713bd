"""What train.py leans on: data and batches, the optimizers and schedules, the time budget,
parallelism, checkpoints and resume, metrics. Only train.py and the lab's training benchmarks
use it."""
