"""Put this directory first on PYTHONPATH and `import wandb` fails as it does where the package is not installed."""

raise ImportError("No module named 'wandb'")
