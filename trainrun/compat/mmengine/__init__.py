"""MMEngine's import paths, on trainrun: replace ``mmengine`` with ``trainrun.compat.mmengine``
in a script's import lines, and its model, metrics and hooks run under trainrun's Runner,
strategies and checkpoints.

Each module translates into trainrun's own parts; there is no second training loop:
``.runner`` (``Runner``, ``FlexibleRunner``, ``load_checkpoint``), ``.model`` (``BaseModel``
with MMEngine's calling convention, ``BaseDataPreprocessor``, the model wrappers),
``.evaluator`` (``BaseMetric``, ``Evaluator``), ``.optim`` (the optimiser wrappers' and the
schedulers' names), ``.hooks`` (``Hook``, ``EMAHook``, the default hooks' names),
``.dataset`` (``DefaultSampler``, ``InfiniteSampler``, ``default_collate``,
``pseudo_collate``), ``.dist`` (trainrun's own ``dist``), ``.registry`` and ``.config``. What
trainrun cannot do as MMEngine does is refused in one line that names it (docs/mmengine.md).
"""
