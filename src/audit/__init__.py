"""Did DPO work on my data, and why not: the audit of the preference data before training and of the answers after.

    python -m src.audit [--config R.yaml] [launcher flags]     # audit a dataset without training (src/audit/__main__.py)

- src/data/pair_audit.py  what the pairs can teach, from the preparation pass the data makes anyway: counts,
                duplicates, lengths, truncation, chosen/rejected overlap (per split, bounded memory: a few numbers a
                row); it lives with the data, which computes it while tokenizing
- reference.py  how the reference model already ranks the training pairs, from the reference log-probs the DPO
                trainer computes or reuses (or, standalone, from a sample)
- judged.py     a judge's verdict on the data's own chosen and rejected answers: labels it ranks the other way
- answers.py    what the trained model now says: held-out answer lengths, cut answers, repetition, before → after
- findings.py   the numbers above → alerts with published thresholds and advice that names a flag

Light modules (no torch, no TRL trainer) but reference.py's forward and judged.py's scoring, which take a model
already loaded. The numbers land in training_info.json (`data_audit`, `answers`), report.md's Data and Answers
sections, plots/data.png, the console's end-of-run lines and `python -m src.reporting.compare`.
"""
