"""An MMEngine-style training script written against trainrun.compat.mmengine: 40 iterations
of a model with dropout that takes its time (``--step-seconds``), a checkpoint every 10, every
iteration logged; ``--resume`` continues from the newest checkpoint in the work directory.
tests/compat/test_faults.py kills it mid-run and resumes it.

    torchrun --nproc_per_node 2 compat_train.py --launcher pytorch --work-dir DIR [--resume]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainrun.compat.mmengine.model import BaseModel
from trainrun.compat.mmengine.runner import Runner


class Points(Dataset):
    def __init__(self, size=96):
        generator = torch.Generator().manual_seed(11)
        self.inputs = torch.randn(size, 12, generator=generator)
        self.labels = (self.inputs[:, :3].sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return dict(inputs=self.inputs[index], labels=self.labels[index])


class SlowNet(BaseModel):
    def __init__(self, step_seconds=0.03):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
        self.step_seconds = step_seconds

    def forward(self, inputs, labels, mode='tensor'):
        if mode == 'loss':
            time.sleep(self.step_seconds)
            return dict(loss=F.cross_entropy(self.net(inputs), labels))
        return self.net(inputs), labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--launcher', default='none')
    parser.add_argument('--work-dir', required=True)
    parser.add_argument('--resume', action='store_true')
    parser.add_argument('--step-seconds', type=float, default=0.03)
    args = parser.parse_args()
    runner = Runner(
        model=dict(type=SlowNet, step_seconds=args.step_seconds),
        work_dir=args.work_dir,
        train_dataloader=dict(batch_size=8, dataset=Points(),
                              sampler=dict(type='DefaultSampler', shuffle=True),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=40),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
        param_scheduler=dict(type='MultiStepLR', by_epoch=False, milestones=[25]),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=10, by_epoch=False),
                           logger=dict(type='LoggerHook', interval=1)),
        randomness=dict(seed=17),
        resume=args.resume,
        launcher=args.launcher)
    runner.train()


if __name__ == '__main__':
    main()
