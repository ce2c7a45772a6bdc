from fsdp_trainer.train import main

main()
