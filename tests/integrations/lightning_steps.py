"""Source of the LightningModule methods the inner projects of the Lightning tests share: an
optimizer and a small regression dataset (the text is spliced into a class body)."""

OPTIMIZER_AND_DATA = """
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
"""
