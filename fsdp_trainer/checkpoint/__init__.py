"""Sharded checkpoints of the whole training state through torch.distributed.checkpoint (DCP).

Layout (this module is the only one that knows it):

    OUT_DIR/checkpoints/step_00000100/   a DCP directory: one file per rank plus `.metadata`; the attachments
                                         (recipe.yaml, the tokenizer's files: tokenizer.model or tokenizer.json +
                                         tokenizer_config.json) that make it self-describing; and checksums.json, the
                                         size and CRC-32 of every other file, written last
    OUT_DIR/checkpoints/latest           text: the name of the newest complete step directory

A weights-only checkpoint (`import_hf`) holds just the `model` entry; loading it starts a fresh optimizer,
data stream and step count.

A step directory counts only once `.metadata` exists and `latest` names it; `latest` is replaced atomically
(temp file + os.replace) after every rank has finished writing, so a crash at any instant leaves `latest` naming a
complete checkpoint. Retention deletes only published steps older than the newest `keep_last`. A save that fails on
any rank (a full disk) fails on every rank at the same step; its partial directory is removed, and the run stops or
goes on as `checkpoint.on_save_error` says.

Reading runs no code: DCP unpickles `.metadata` and the non-tensor entries, which a checkpoint from elsewhere could
fill with any callable; CheckpointReader and CheckpointLoadPlanner admit only what DCP's own files are made of.

Checksums: each rank hashes the files it wrote (in the background thread for async saves), and the coordinator folds
them into checksums.json before `latest` may name the step. Every file is verified before it is trusted: on resume
(the files split over the ranks), by consolidation and the inference loader, and by tools/verify_checkpoint.py. With
`resume: auto` a checkpoint that fails falls back to the newest older one that verifies; one saved before checksums
existed loads with a notice that it is unverified.

The Checkpointer decides when to save: every `checkpoint.every` steps, after the last step, and at once when SIGTERM
reaches any rank (preemption), whatever `every` says.
"""
