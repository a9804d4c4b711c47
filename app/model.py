"""The networks of the built-in tasks (no Ray, no torch.distributed here).

``ConvNet`` is the seed's network: Mastering PyTorch, chapter 11 (``convnet_distributed.py``).
``ExamplesConvNet`` is the larger network of PyTorch's MNIST example, kept for comparison.
``cifar_resnet18`` is torchvision's ResNet-18 adapted to 32x32 images.
"""

import warnings

import torch
from torch import nn
from torch.nn import functional as F

# The book applies Dropout2d to the (N, 64) output of fc1. torch warns that 2-D input is
# deprecated there and treats it as one unbatched (N, 64) feature map: whole samples'
# activations are dropped. That is the book's network, kept exactly; the warning is not news.
warnings.filterwarnings("ignore", message="dropout2d: Received a 2-D input")


class ConvNet(nn.Module):
    """The book's digit classifier: two 3x3 convolutions (16, 32 channels), max-pool,
    Dropout2d(0.10), Linear(4608, 64), Dropout2d(0.25), Linear(64, 10); log-probabilities."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.cn1 = nn.Conv2d(1, 16, 3, 1)
        self.cn2 = nn.Conv2d(16, 32, 3, 1)
        self.dp1 = nn.Dropout2d(0.10)
        self.dp2 = nn.Dropout2d(0.25)
        self.fc1 = nn.Linear(4608, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.cn1(x))
        x = F.relu(self.cn2(x))
        x = F.max_pool2d(x, 2)
        x = self.dp1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dp2(x)
        return F.log_softmax(self.fc2(x), dim=1)


class ExamplesConvNet(nn.Module):
    """PyTorch's MNIST example network (32/64 channels, 9216 -> 128): about four times the
    compute per sample of ``ConvNet``."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def cifar_resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 for 32x32 inputs: a 3x3 stride-1 stem and no max-pool (the
    ImageNet stem would shrink a CIFAR image to 8x8 before the first block)."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
