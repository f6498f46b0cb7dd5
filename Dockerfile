# One image for every redisdask role: scheduler, worker (with its nannies), demo.
# Build: docker build -t redisdask .   (compose.yaml builds it for you)
FROM python:3.11-slim
WORKDIR /opt/redisdask-src
COPY pyproject.toml README.md ./
COPY redisdask ./redisdask
COPY workers ./workers
COPY nanny ./nanny
RUN pip install --no-cache-dir '.[dashboard]' \
    && useradd --create-home --uid 1000 redisdask \
    && mkdir -p /scratch && chown redisdask /scratch
USER redisdask
# not the source folder: there `python -m redisdask` would import ./redisdask, which lacks
# the redisdask.workers and redisdask.nanny the install maps in from ./workers and ./nanny
WORKDIR /home/redisdask
# spilled data and the nannies' worker logs
ENV REDISDASK__WORKER__LOCAL_DIRECTORY=/scratch
ENTRYPOINT ["redisdask"]
CMD ["--help"]
