"""critic-eval: how good is a critic? Step-error items with exact labels (``items``), the
scores of parsed critiques per voting rule and N (``scores``) and the config and stages that
run it (``stages``; the Prefect flow and CLI are ``flows/critic_eval.py``)."""
