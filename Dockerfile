# syntax=docker/dockerfile:1
#
# orderdelay container image.
#
#   docker build --build-arg VERSION=1.2.3 --build-arg REVISION=$(git rev-parse HEAD) -t orderdelay:1.2.3 .
#
# The build stage compiles a fully static binary (CGO_ENABLED=0, no libc), so
# the runtime stage can be distroless "static": no shell, no package manager,
# nothing but CA certificates, tzdata and /etc/passwd with the nonroot user.
# deploy/validate/image_test.go runs the same `go build` command (it reads it
# from this file) and checks that the binary is static and stamped.

ARG GO_VERSION=1.26

FROM --platform=$BUILDPLATFORM golang:${GO_VERSION}-bookworm AS build
# Set by BuildKit to the target platform (cross-compiling from the build
# host, no emulation); empty with the legacy builder, where Go's own default
# (the build host's platform) applies.
ARG TARGETOS
ARG TARGETARCH
ARG VERSION=dev
ARG REVISION=unknown
WORKDIR /src
# Dependencies first, so a source change does not re-download modules.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} \
    go build -trimpath -ldflags "-s -w -X main.version=${VERSION} -X main.revision=${REVISION}" \
      -o /out/orderdelay ./cmd/orderdelay

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/orderdelay /orderdelay
# Numeric on purpose: with runAsNonRoot the kubelet can only verify a numeric
# UID; a named user ("nonroot") makes it refuse to start the pod.
USER 65532:65532
# In a container the API must listen beyond loopback (the binary's default
# is 127.0.0.1:8080), so the image needs ORDERDELAY_API_TOKEN, or refuses to
# start (protected mode; ORDERDELAY_API_AUTH=none switches auth off).
ENV ORDERDELAY_HTTP_ADDR=:8080
EXPOSE 8080
ENTRYPOINT ["/orderdelay"]
CMD ["run"]
