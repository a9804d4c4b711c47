import torch

from app.model import ConvNet, ExamplesConvNet, cifar_resnet18


def test_output_is_log_probabilities_per_class():
    model = ConvNet().eval()
    output = model(torch.randn(5, 1, 28, 28))
    assert output.shape == (5, 10)
    torch.testing.assert_close(output.exp().sum(dim=1), torch.ones(5))


def test_the_books_architecture_exactly():
    """Mastering PyTorch, chapter 11: Conv2d(1,16,3), Conv2d(16,32,3), Dropout2d(0.10),
    Linear(4608,64), Dropout2d(0.25), Linear(64,10)."""
    model = ConvNet()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {
        "cn1.weight": (16, 1, 3, 3), "cn1.bias": (16,),
        "cn2.weight": (32, 16, 3, 3), "cn2.bias": (32,),
        "fc1.weight": (64, 4608), "fc1.bias": (64,),
        "fc2.weight": (10, 64), "fc2.bias": (10,),
    }
    assert (type(model.dp1), model.dp1.p, type(model.dp2), model.dp2.p) == \
        (torch.nn.Dropout2d, 0.10, torch.nn.Dropout2d, 0.25)
    assert sum(p.numel() for p in ExamplesConvNet().parameters()) == 1_199_882


def test_cifar_resnet18_keeps_32x32_resolution_into_the_blocks():
    model = cifar_resnet18().eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert model.conv1.stride == (1, 1) and isinstance(model.maxpool, torch.nn.Identity)
