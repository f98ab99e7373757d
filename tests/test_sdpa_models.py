"""Models that call F.scaled_dot_product_attention, run under the SDPA takeover (attnx.sdpa) and without it:
diffusers' UNet2DConditionModel and SD3 transformer (a DiT), timm's ViT on its fused-attention path and
torchvision's ViT, each built small from a config with random weights. The outputs (and a training step's
gradients) must match PyTorch's own kernel's, and the model must reach the op attnx serves (counted with a
dispatch mode), or the comparison would prove nothing."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnx

pytestmark = pytest.mark.integration

FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
MISSING = "{} is not installed (make models installs it)"


class OpCounter(TorchDispatchMode):
    """How many times each aten op ran below autograd."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def check_model(model, make_inputs, *, train=False, atol=1e-5):
    """model(**make_inputs()) with and without the takeover: outputs (and, with train, the parameters'
    gradients of a squared-sum loss) equal within atol; the SDPA op reached."""

    def run():
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            out = model(**make_inputs())
            out = out.sample if hasattr(out, "sample") else out
            if train:
                out.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return out.detach(), grads

    expected = run()
    with attnx.sdpa.enabled(), OpCounter() as counter:
        actual = run()
    assert counter.counts.get(FORWARD, 0) > 0, f"the model never reached {FORWARD}: {counter.counts}"
    if train:
        assert counter.counts.get(BACKWARD, 0) > 0
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=atol)
    assert len(actual[1]) == len(expected[1])
    for a, e in zip(actual[1], expected[1], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=atol * max(1.0, e.abs().max().item()))


@pytest.mark.wheel
def test_diffusers_unet():
    diffusers = pytest.importorskip("diffusers", reason=MISSING.format("diffusers"))
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8,
    )

    def inputs():
        gen = torch.Generator().manual_seed(1)
        return dict(sample=torch.randn(2, 4, 16, 16, generator=gen), timestep=torch.tensor([10, 20]),
                    encoder_hidden_states=torch.randn(2, 7, 32, generator=gen))

    check_model(unet.eval(), inputs)
    check_model(unet.train(), inputs, train=True)


def test_diffusers_sd3_transformer():
    diffusers = pytest.importorskip("diffusers", reason=MISSING.format("diffusers"))
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=4,
    ).eval()

    def inputs():
        gen = torch.Generator().manual_seed(1)
        return dict(hidden_states=torch.randn(2, 4, 16, 16, generator=gen),
                    encoder_hidden_states=torch.randn(2, 7, 32, generator=gen),
                    pooled_projections=torch.randn(2, 64, generator=gen), timestep=torch.tensor([1, 2]))

    check_model(model, inputs)


def test_timm_vit_fused_attention():
    timm = pytest.importorskip("timm", reason=MISSING.format("timm"))
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8)

    def inputs():
        return dict(x=torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))

    check_model(model.eval(), inputs)
    check_model(model.train(), inputs, train=True)


def test_torchvision_vit_training():
    vision_transformer = pytest.importorskip(
        "torchvision.models.vision_transformer", reason=MISSING.format("torchvision")
    )
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )

    def inputs():
        return dict(x=torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))

    # In training nn.MultiheadAttention calls SDPA (in eval it takes torch's fused fast path instead).
    check_model(model.train(), inputs, train=True)
