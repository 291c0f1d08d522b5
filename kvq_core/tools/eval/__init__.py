"""Real-model evaluation: ``kvq eval ppl`` (:mod:`kvq_core.tools.eval.ppl`) and ``kvq eval niah``
(:mod:`kvq_core.tools.eval.niah`), each a ``main(argv) -> int``. Loading in :mod:`.model` and
:mod:`.text`, cache configurations in :mod:`.caches`, tables and plots in :mod:`.report`."""
