"""Fine-tuning (`attnres finetune`, `attnres ab`). Start at training.py: FinetuneRecipe, setup -> train -> save.

recipe            the YAML schema, loading and key.path=value overrides (no file system)
preflight         what the file system can tell about a recipe before anything is loaded or written
starting_model    the model a run starts from (converted, baseline, or an AttnRes folder)
data              a recipe's training and held-out corpus (text pipeline: io.text) and its resumable order
optim             what trains: parameter selection, LoRA, AdamW groups, LR schedules, gradient clipping
accelerator       the Accelerator of one run
training          FinetuneRecipe: setup, the training loop and its steps, save; `finetune()`
evaluation        held-out loss during a run, over every process
checkpoints       resumable checkpoints (Accelerate's save_state, trainable weights only)
metrics           metrics.jsonl: what a step measured, held-out evaluations
reporting         the console: stage lines, progress bar
stopping          how a run ends early: its errors and SIGINT / SIGTERM handling
run_folder        output.dir: its files, resume checks, staging a run that replaces an earlier one
result            final metrics, the loss curve, the model folder and its card
ab                `attnres ab`: baseline vs AttnRes arms over seeds, and its report
recipe_reference  docs/recipes.md, generated from the schema
"""
