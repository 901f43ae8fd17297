"""A seeded MMEngine training script: run by MMEngine itself (mmengine_on_cpu.py) and, with only
its import lines changed, by trainrun.compat.mmengine (tests/compat/test_mmengine_numbers.py).

Written the way MMEngine's docs teach: a registered BaseModel, datasets and dataloaders given
as dicts, a BaseMetric, ``randomness=dict(seed=...)`` and a custom hook.  The hook writes one
JSON line per training iteration per rank (``losses_rank<R>.jsonl`` in the work dir) with the
loss as a full-precision Python float, so runs can be compared within 1e-6.

Run (single process):
    python mmengine_on_cpu.py --launcher none --work-dir /tmp/mm_1p
Run (2 processes, CPU; MMEngine 0.10.7 needs the three CPU patches of mmengine_on_cpu.py):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 mmengine_on_cpu.py --launcher pytorch ...
"""
import argparse
import json
import os
import os.path as osp

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.dist import get_rank
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, HOOKS, METRICS, MODELS
from mmengine.runner import Runner
from torch.utils.data import Dataset

NUM_FEATURES = 16
NUM_CLASSES = 4


@DATASETS.register_module()
class ToyDataset(Dataset):
    """256 (or ``num_samples``) samples of 16 features and 4 classes, made offline.

    The class centres come from a private generator seeded with 0 (shared by the train and
    val sets); labels and noise from one seeded with ``data_seed``.  Building the data set
    neither reads nor advances the global torch RNG.
    """

    def __init__(self, num_samples=256, data_seed=1234, data_format='dict', jitter=0.0):
        centres = torch.randn(NUM_CLASSES, NUM_FEATURES,
                              generator=torch.Generator().manual_seed(0)) * 0.5
        g = torch.Generator().manual_seed(data_seed)
        self.labels = torch.randint(0, NUM_CLASSES, (num_samples, ), generator=g)
        noise = torch.randn(num_samples, NUM_FEATURES, generator=g)
        self.inputs = centres[self.labels] + noise
        self.data_format = data_format
        self.jitter = jitter  # > 0: an augmentation drawing from numpy's global generator

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        if self.jitter:
            inputs = self.inputs[idx] + float(np.random.uniform(-self.jitter, self.jitter))
            return dict(inputs=inputs, labels=self.labels[idx])
        if self.data_format == 'tuple':
            # The docs' 15-minute tutorial style: (inputs, label) tuples.
            return self.inputs[idx], self.labels[idx]
        return dict(inputs=self.inputs[idx], labels=self.labels[idx])


class InitLinear(nn.Linear):
    """A layer with its own ``init_weights``, which MMEngine's BaseModule.init_weights calls
    for a child module that has one."""

    def init_weights(self):
        nn.init.normal_(self.weight, std=0.3)
        nn.init.uniform_(self.bias, -0.1, 0.1)


@MODELS.register_module()
class Net(BaseModel):
    """A 16-32-4 MLP; built from ``dict(type='Net')`` so its init runs after the seeding."""

    def __init__(self, hidden=32, dropout=0.0, custom_init=False):
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, hidden)
        self.fc2 = (InitLinear if custom_init else nn.Linear)(hidden, NUM_CLASSES)
        self.dropout = dropout  # > 0: each rank's own random stream shows in its losses
        self.custom_init = custom_init

    def init_weights(self):
        """With ``custom_init``: fc1 drawn again here, fc2 by its own init_weights (through
        BaseModel's); the runner calls this before training."""
        if self.custom_init:
            nn.init.kaiming_uniform_(self.fc1.weight, a=1.0)
        super().init_weights()

    def forward(self, inputs, labels, mode='tensor'):
        x = F.relu(self.fc1(inputs))
        if self.dropout:
            x = F.dropout(x, self.dropout, self.training)
        x = self.fc2(x)
        if mode == 'loss':
            return {'loss': F.cross_entropy(x, labels)}
        elif mode == 'predict':
            return x, labels
        return x


@METRICS.register_module()
class Accuracy(BaseMetric):

    def process(self, data_batch, data_samples):
        score, gt = data_samples
        self.results.append({
            'batch_size': len(gt),
            'correct': (score.argmax(dim=1) == gt).sum().cpu(),
        })

    def compute_metrics(self, results):
        total_correct = sum(item['correct'] for item in results)
        total_size = sum(item['batch_size'] for item in results)
        return dict(accuracy=100 * float(total_correct) / total_size)


@HOOKS.register_module()
class LossRecorderHook(Hook):
    """Appends one JSON line per training iteration (per rank) to the work dir."""

    def before_run(self, runner):
        self.path = osp.join(runner.work_dir, f'losses_rank{get_rank()}.jsonl')
        self.val_path = osp.join(runner.work_dir, f'val_rank{get_rank()}.jsonl')
        for p in (self.path, self.val_path):
            if osp.exists(p):
                os.remove(p)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if isinstance(data_batch, dict):
            inputs, labels = data_batch['inputs'], data_batch['labels']
        else:
            inputs, labels = data_batch
        record = dict(
            rank=get_rank(),
            iter=runner.iter,  # 0-based; the loop increments it after this hook
            epoch=runner.epoch,  # 0-based
            batch_idx=batch_idx,
            loss=float(outputs['loss'].item()),
            lr=float(runner.optim_wrapper.get_lr()['lr'][0]),
            labels=[int(v) for v in labels],
            inputs_sum=float(inputs.double().sum().item()),
        )
        with open(self.path, 'a') as f:
            f.write(json.dumps(record) + '\n')

    def after_val_epoch(self, runner, metrics=None):
        with open(self.val_path, 'a') as f:
            f.write(json.dumps(dict(rank=get_rank(), epoch=runner.epoch,
                                    metrics=metrics)) + '\n')


def parse_args():
    parser = argparse.ArgumentParser(description='Seeded MMEngine oracle run')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    parser.add_argument('--work-dir', default='/tmp/mm_oracle_work')
    parser.add_argument('--seed', type=int, default=42)
    parser.add_argument('--data-format', choices=['dict', 'tuple'], default='dict')
    parser.add_argument('--iter-based', action='store_true',
                        help='IterBasedTrainLoop over an InfiniteSampler, for 40 iterations')
    parser.add_argument('--init-weights', action='store_true',
                        help="a model whose init_weights draws its weights again")
    parser.add_argument('--diff-rank-seed', action='store_true',
                        help='randomness.diff_rank_seed, with dropout 0.5 in the model and '
                        'a numpy jitter in the training data')
    args = parser.parse_args()
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def main():
    args = parse_args()
    dataset = dict(type='ToyDataset', num_samples=256, data_seed=1234,
                   data_format=args.data_format,
                   jitter=0.1 if args.diff_rank_seed else 0.0)
    val_dataset = dict(type='ToyDataset', num_samples=64, data_seed=4321,
                       data_format=args.data_format)
    model = dict(type='Net', dropout=0.5 if args.diff_rank_seed else 0.0,
                 custom_init=args.init_weights)
    checkpoint = dict(type='CheckpointHook', interval=1)
    sampler = dict(type='DefaultSampler', shuffle=True)
    scheduler = dict(type='MultiStepLR', by_epoch=True, milestones=[2], gamma=0.1)
    loop = dict(by_epoch=True, max_epochs=3, val_interval=1)
    if args.iter_based:
        checkpoint = dict(type='CheckpointHook', interval=20, by_epoch=False)
        sampler = dict(type='InfiniteSampler', shuffle=True)
        scheduler = dict(type='MultiStepLR', by_epoch=False, milestones=[25], gamma=0.1)
        loop = dict(type='IterBasedTrainLoop', max_iters=40, val_interval=20)

    runner = Runner(
        model=model,
        work_dir=args.work_dir,
        train_dataloader=dict(
            batch_size=8,
            num_workers=0,
            dataset=dataset,
            sampler=sampler,
            collate_fn=dict(type='default_collate')),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
        param_scheduler=scheduler,
        train_cfg=loop,
        val_dataloader=dict(
            batch_size=8,
            num_workers=0,
            dataset=val_dataset,
            sampler=dict(type='DefaultSampler', shuffle=False),
            collate_fn=dict(type='default_collate')),
        val_cfg=dict(),
        val_evaluator=dict(type=Accuracy),
        default_hooks=dict(checkpoint=checkpoint),
        custom_hooks=[dict(type='LossRecorderHook')],
        randomness=dict(seed=args.seed, diff_rank_seed=args.diff_rank_seed),
        launcher=args.launcher,
    )
    runner.train()


if __name__ == '__main__':
    main()
