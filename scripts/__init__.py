"""The demo model's training and evaluation scripts (not part of the installed package).

`train_demo_model` trains the bundled target and draft models, `distill_draft` distills the
draft from the target's own outputs, `eval_demo_model` evaluates both on held-out files and
`copy_probe` measures whether a model copies from its context; `muon`, `copy_heads` and
`json_answers` are pieces of the training recipe. They import each other as a package, so run
them as modules from the repository root, e.g. `python -m scripts.train_demo_model --help`.
"""
