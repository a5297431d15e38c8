"""Generated wire stubs (`make proto`); do not edit. The sources are proto/vericache/."""
