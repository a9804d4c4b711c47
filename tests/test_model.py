import torch

from app.model import ConvNet


def test_output_is_log_probabilities_per_class():
    model = ConvNet().eval()
    output = model(torch.randn(5, 1, 28, 28))
    assert output.shape == (5, 10)
    torch.testing.assert_close(output.exp().sum(dim=1), torch.ones(5))


def test_reference_architecture():
    model = ConvNet()
    assert sum(p.numel() for p in model.parameters()) == 1_199_882
