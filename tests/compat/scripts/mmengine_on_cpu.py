"""Run seeded_mmengine.py under MMEngine 0.10.7 on CPU, with exactly three patches: the oracle
of tests/compat/test_mmengine_numbers.py.

MMEngine 0.10.7's distributed path assumes CUDA.  Only these are patched, in this process,
before the script's ``main`` runs; nothing that computes a loss is touched:

1. ``torch.cuda.set_device`` (called by ``mmengine/dist/utils.py`` ``_init_dist_pytorch``)
   becomes a no-op when CUDA is unavailable.
2. The default backend: ``Runner`` defaults to ``env_cfg=dict(dist_cfg=dict(backend='nccl'))``;
   ``init_dist`` as imported by ``mmengine.runner.runner`` is wrapped to use ``gloo`` instead.
3. ``Runner.wrap_model`` passes ``device_ids=[LOCAL_RANK]`` to ``MMDistributedDataParallel``,
   which torch rejects for a CPU module; the wrapper's ``__init__`` drops ``device_ids``.

Usage:
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 mmengine_on_cpu.py --launcher pytorch \
        --work-dir DIR
    python mmengine_on_cpu.py --launcher none --work-dir DIR
All arguments go to seeded_mmengine.py.  After the script returns, the wrapper destroys the
process group (a clean exit, no effect on any number).
"""
import os.path as osp
import runpy
import sys

import torch


def apply_cpu_patches() -> None:
    # Patch 1: torch.cuda.set_device is a no-op without CUDA.
    if not torch.cuda.is_available():
        torch.cuda.set_device = lambda device: None

    # Patch 2: default distributed backend gloo instead of nccl.
    import mmengine.runner.runner as runner_module
    original_init_dist = runner_module.init_dist

    def init_dist_gloo(launcher, backend='nccl', **kwargs):
        if backend == 'nccl':
            backend = 'gloo'
        return original_init_dist(launcher, backend=backend, **kwargs)

    runner_module.init_dist = init_dist_gloo

    # Patch 3: MMDistributedDataParallel without device_ids on CPU.
    from mmengine.model import MMDistributedDataParallel
    original_ddp_init = MMDistributedDataParallel.__init__

    def ddp_init_cpu(self, module, detect_anomalous_params=False, **kwargs):
        if not torch.cuda.is_available():
            kwargs.pop('device_ids', None)
        original_ddp_init(self, module, detect_anomalous_params=detect_anomalous_params,
                          **kwargs)

    MMDistributedDataParallel.__init__ = ddp_init_cpu


if __name__ == '__main__':
    apply_cpu_patches()
    script = osp.join(osp.dirname(osp.abspath(__file__)), 'seeded_mmengine.py')
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name='__main__')
    # Not a patch: after training, tear the gloo group down.  Without this the 2-process run
    # finishes all 3 epochs but rank 1 aborts at interpreter exit ("terminate called without
    # an active exception"), and torchrun reports exit code 1.
    # A barrier first, so neither rank tears down while the other still uses the group.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
