# examples/own_model/blobs.py
"""A data set and a model of your own: points around three centres, and an MLP."""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from trainrun.wrappers import BaseModel


class Blobs(Dataset):
    DEFAULT_METRICS = ["accuracy"]  # what validation and test score, unless data.val says

    def __init__(self, split: str = "train", size: int = 600):
        g = torch.Generator().manual_seed(["train", "val", "test"].index(split))
        self.labels = torch.randint(0, 3, (size,), generator=g)
        centres = torch.tensor([[0.0, 2.0], [-2.0, -1.0], [2.0, -1.0]])
        self.points = centres[self.labels] + torch.randn(size, 2, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):  # a sample is a dict; the batch collated from them is too
        return {"inputs": self.points[i], "labels": self.labels[i]}


class BlobNet(BaseModel):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, batch, mode="loss"):
        logits = self.net(batch["inputs"])
        if mode == "loss":  # training: a dict of losses, summed and logged
            return {"loss": F.cross_entropy(logits, batch["labels"])}
        return logits.argmax(dim=1)  # "predict": what accuracy compares with batch["labels"]
