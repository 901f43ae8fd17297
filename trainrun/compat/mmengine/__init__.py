"""MMEngine's import paths, on trainrun: replace ``mmengine`` with ``trainrun.compat.mmengine``
in a script's import lines, and its model, metrics and hooks run under trainrun's Runner,
strategies and checkpoints.

Each module translates into trainrun's own parts; there is no second training loop. So far:
``.model`` (``BaseModel`` with MMEngine's calling convention, ``BaseDataPreprocessor``, the
model wrappers), ``.evaluator`` (``BaseMetric``, ``Evaluator``), ``.hooks`` (``Hook`` and
``HookAdapter``), ``.dataset`` (``DefaultSampler``, ``default_collate``, ``pseudo_collate``),
``.dist`` (trainrun's own ``dist``), ``.registry`` and ``.config``. What trainrun cannot do
as MMEngine does is refused in one line that names it.
"""
