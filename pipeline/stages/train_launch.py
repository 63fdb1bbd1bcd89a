"""``python -m pipeline.stages.train_launch --config FILE --round K``: the train stage as a program,
what ``train.launcher`` (``accelerate launch``, ``torchrun``) starts in each process
(:func:`pipeline.stages.train.main`). A module of its own, so the stage module the registry imports
is not run a second time as ``__main__``."""

from pipeline.stages.train import main

if __name__ == "__main__":
    main()
