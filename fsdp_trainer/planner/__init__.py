"""The planner: memory, step time and a fake-tensor check of a recipe before it runs. It reads the trainer; the trainer
never reads it."""
