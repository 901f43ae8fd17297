"""MMEngine's examples/distributed_training_with_flexible_runner.py as a user brings it, with
its imports pointed at trainrun.compat.mmengine: the same strategies and options (FSDP with a
size-based wrap policy and AmpOptimWrapper; DeepSpeed ZeRO-3 with fp16, inputs_to_half and
DeepSpeedOptimWrapper; DDP by default), the same LinearLR and loop. Its torchvision ResNet-50
and CIFAR-10 are replaced by a small CNN and offline random images (torchvision has no build
for the CPU torch here). tests/compat/test_examples.py runs it on 2 processes.

    torchrun --nproc_per_node 2 flexible_example.py [--use-fsdp | --use-deepspeed] --work-dir DIR
"""
import argparse
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from trainrun.compat.mmengine.evaluator import BaseMetric
from trainrun.compat.mmengine.model import BaseModel
from trainrun.compat.mmengine.runner._flexible_runner import FlexibleRunner


class SmallCNN(BaseModel):

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, imgs, labels, mode):
        x = self.net(imgs)
        if mode == 'loss':
            return {'loss': F.cross_entropy(x, labels)}
        elif mode == 'predict':
            return x, labels


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
        return dict(accuracy=100 * total_correct / total_size)


class RandomImages(torch.utils.data.Dataset):
    """64 offline 3x32x32 images in 10 classes: CIFAR-10's shapes."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, 32, 32, generator=generator), index % 10


def parse_args():
    parser = argparse.ArgumentParser(description='Distributed Training')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    parser.add_argument('--use-fsdp', action='store_true')
    parser.add_argument('--use-deepspeed', action='store_true')
    parser.add_argument('--work-dir', required=True)
    return parser.parse_args()


def main():
    args = parse_args()
    train_dataloader = dict(
        batch_size=16,
        dataset=RandomImages(),
        sampler=dict(type='DefaultSampler', shuffle=True),
        collate_fn=dict(type='default_collate'))
    val_dataloader = dict(
        batch_size=16,
        dataset=RandomImages(),
        sampler=dict(type='DefaultSampler', shuffle=False),
        collate_fn=dict(type='default_collate'))

    if args.use_deepspeed:
        strategy = dict(
            type='DeepSpeedStrategy',
            fp16=dict(
                enabled=True,
                fp16_master_weights_and_grads=False,
                loss_scale=0,
                loss_scale_window=500,
                hysteresis=2,
                min_loss_scale=1,
                initial_scale_power=15,
            ),
            inputs_to_half=[0],
            zero_optimization=dict(
                stage=3,
                allgather_partitions=True,
                reduce_scatter=True,
                allgather_bucket_size=50000000,
                reduce_bucket_size=50000000,
                overlap_comm=True,
                contiguous_gradients=True,
                cpu_offload=False))
        optim_wrapper = dict(
            type='DeepSpeedOptimWrapper', optimizer=dict(type='AdamW', lr=1e-3))
    elif args.use_fsdp:
        policy = partial(size_based_auto_wrap_policy, min_num_params=1e2)
        strategy = dict(type='FSDPStrategy', model_wrapper=dict(auto_wrap_policy=policy))
        optim_wrapper = dict(type='AmpOptimWrapper', optimizer=dict(type='AdamW', lr=1e-3))
    else:
        strategy = None
        optim_wrapper = dict(type='AmpOptimWrapper', optimizer=dict(type='AdamW', lr=1e-3))

    runner = FlexibleRunner(
        model=SmallCNN(),
        work_dir=args.work_dir,
        strategy=strategy,
        train_dataloader=train_dataloader,
        optim_wrapper=optim_wrapper,
        param_scheduler=dict(type='LinearLR'),
        train_cfg=dict(by_epoch=True, max_epochs=3, val_interval=1),
        val_dataloader=val_dataloader,
        val_cfg=dict(),
        val_evaluator=dict(type=Accuracy))
    runner.train()


if __name__ == '__main__':
    main()
