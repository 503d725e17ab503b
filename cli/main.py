import click

@click.group()
def main():
    """hami-bpf"""
