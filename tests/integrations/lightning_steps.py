"""Source the inner projects of the Lightning tests share: a LightningModule's optimizer and a
small regression dataset (spliced into a class body), and a whole regression model trained
from a datamodule (``pl``, ``torch`` imported before it)."""

OPTIMIZER_AND_DATA = """
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
"""

# a module of its own (no data: a LightningDataModule gives it)
DATAMODULE_MODEL = """
class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)"""
