# Switchboard on Nomad, with membership in Consul.
#
#   nomad job run -var image=registry.example.com/switchboard:0.1.0 deploy/nomad/switchboard.nomad.hcl
#   nomad var put nomad/jobs/switchboard admin_token=$(openssl rand -hex 32) \
#       cluster_token=$(openssl rand -hex 32) metrics_token=$(openssl rand -hex 32) \
#       api_keys='sk-...:acme:plus,...'
#
# cluster_token is SWITCHBOARD_CLUSTER_TOKEN, which every task below holds: the hops between
# gateways, shards and cache nodes carry it, and a pipeline stage proves it before it joins a group.
# Every task's /metrics takes it too (the gateway's series name tenants and their token volumes):
# Prometheus scrapes with `authorization: {type: Bearer, credentials_file: ...}` (alerts/prometheus.example.yml).
# metrics_token is SWITCHBOARD_METRICS_TOKEN, which every task below also gets (as Kubernetes' optional
# `metrics-token` Secret key): it opens /metrics and nothing else, so it is the token to give Prometheus.
# Optional: a variable without it starts every task (no "<no value>": the template ranges over the
# variable's keys instead of reading a missing one), and /metrics then takes the cluster token alone.
# Adding it later (`nomad var put` of the path with every key again, metrics_token added) re-renders the
# templates, which restarts the tasks (the templates' default change_mode).
#
# Every client node runs a Consul agent on its own address (:8500), as Nomad's Consul
# integration expects. Groups:
#
#   control-plane  1     admin API, signals, degradation ladder, and the autoscaler, which scales
#                        the `shard` group below through Nomad's job scale API (--actuator nomad)
#   gateway        2     the chat API; watches shards and cache nodes in Consul
#   cache          2     session transcripts
#   shard          1..8  inference; *Nomad* registers these in Consul (service block below), so a
#                        shard being removed leaves routing first (deregistered, then shutdown_delay),
#                        then gets SIGTERM and finishes its in-flight requests (kill_timeout).
#                        With shard_pipeline_parallel_size = N each allocation is one whole pipeline
#                        group (a task group per pipeline): the task is stage 0, which starts stages
#                        1..N-1 as its children on the same node; losing one exits the task (status 1)
#                        and Nomad restarts the group. Its cpu is N stages x shard_threads_per_stage.
#                        Stages on different nodes: switchboard-pipeline.nomad.hcl (a job per group;
#                        with --pipeline-group-template the autoscaler registers those jobs instead).
#
# The control plane, gateways and cache nodes register themselves (--membership consul://…) with
# TTL checks; they bind to the node's address (not 0.0.0.0) because the URL they register is the
# address they bind. The autoscaler needs a Nomad ACL token with read-job-scaling and scale-job on
# this job's namespace (NOMAD_TOKEN, from the Nomad variable above when ACLs are on).

variable "image" {
  type        = string
  description = "Container image with the switchboard package installed (console script `switchboard`)."
  default     = "switchboard:0.1.0"
}

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "shard_engine" {
  type        = string
  description = "torch (CPU, default model) | vllm (GPU nodes) | synthetic (no model)."
  default     = "torch"
}

variable "shard_pipeline_parallel_size" {
  type        = number
  description = "Stage processes each shard's layers are split over (torch engine; docs/SHARDING.md). A group's task runs all of them."
  default     = 1
}

variable "shard_threads_per_stage" {
  type    = number
  default = 4
}

variable "shard_max_num_seqs" {
  type    = number
  default = 16
}

job "switchboard" {
  datacenters = var.datacenters
  type        = "service"

  update {
    max_parallel     = 1
    min_healthy_time = "10s"
    healthy_deadline = "5m"
    auto_revert      = true
  }

  group "control-plane" {
    count = 1

    network {
      port "http" { static = 8300 }
    }

    # gateways find the control plane (degradation level, tier policy) by this name
    service {
      name     = "switchboard-control-plane"
      port     = "http"
      provider = "consul"
      check {
        type     = "http"
        path     = "/health"
        interval = "5s"
        timeout  = "2s"
      }
    }

    task "control-plane" {
      driver = "docker"

      config {
        image        = var.image
        network_mode = "host"
        command      = "switchboard"
        args = [
          "control-plane",
          "--host", "${NOMAD_IP_http}",
          "--port", "${NOMAD_PORT_http}",
          "--membership", "consul://${attr.unique.network.ip-address}:8500",
          "--state-dir", "/alloc/data/state",
          "--autoscale",
          "--actuator", "nomad",
          "--nomad-job", "${NOMAD_JOB_ID}",
          "--nomad-group", "shard",
          "--min-replicas", "1",
          "--max-replicas", "8",
          "--ttft-slo-s", "2",
          "--scale-down-cooldown-s", "300"
        ]
      }

      env {
        NOMAD_ADDR = "http://${attr.unique.network.ip-address}:4646"
      }

      template {
        destination          = "secrets/switchboard.env"
        env                  = true
        error_on_missing_key = true # a key missing from the variable stops the task (never "<no value>")
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_ADMIN_TOKEN={{ .admin_token }}{{ end }}
          {{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_CLUSTER_TOKEN={{ .cluster_token }}{{ end }}
          {{ with nomadVar "nomad/jobs/switchboard" }}{{ range $k, $v := . }}{{ if eq $k "metrics_token" }}SWITCHBOARD_METRICS_TOKEN={{ $v }}{{ end }}{{ end }}{{ end }}
        EOT
      }

      resources {
        cpu    = 500
        memory = 256
      }
    }
  }

  group "gateway" {
    # one datacenter (zone) losing everything must not take every replica with it
    spread {
      attribute = "${node.datacenter}"
    }

    count = 2

    network {
      port "http" {}
    }

    # For a load balancer in front (Traefik, Fabio, Consul API gateway): a separate name, so it
    # never mixes with the gateways' own `switchboard-gateway` registrations.
    service {
      name     = "switchboard-api"
      port     = "http"
      provider = "consul"
      tags     = ["http", "openai-compatible"]
      check {
        type     = "http"
        path     = "/health"
        interval = "5s"
        timeout  = "2s"
      }
    }

    task "gateway" {
      driver = "docker"

      config {
        image        = var.image
        network_mode = "host"
        command      = "switchboard"
        args = [
          "gateway",
          "--host", "${NOMAD_IP_http}",
          "--port", "${NOMAD_PORT_http}",
          "--membership", "consul://${attr.unique.network.ip-address}:8500",
          "--control-plane-url", "http://switchboard-control-plane.service.consul:8300",
          "--node-id", "gateway-${NOMAD_ALLOC_ID}",
          "--zone", "${node.datacenter}"
        ]
      }

      template {
        destination          = "secrets/gateway.env"
        env                  = true
        error_on_missing_key = true # a key missing from the variable stops the task (never "<no value>")
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_GATEWAY_API_KEYS={{ .api_keys }}{{ end }}
          {{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_CLUSTER_TOKEN={{ .cluster_token }}{{ end }}
          {{ with nomadVar "nomad/jobs/switchboard" }}{{ range $k, $v := . }}{{ if eq $k "metrics_token" }}SWITCHBOARD_METRICS_TOKEN={{ $v }}{{ end }}{{ end }}{{ end }}
        EOT
      }

      resources {
        cpu    = 1000
        memory = 512
      }
    }
  }

  group "cache" {
    # one datacenter (zone) losing everything must not take every replica with it
    spread {
      attribute = "${node.datacenter}"
    }

    count = 2

    network {
      port "http" {}
    }

    task "cache-node" {
      driver = "docker"

      config {
        image        = var.image
        network_mode = "host"
        command      = "switchboard"
        args = [
          "cache-node",
          "--host", "${NOMAD_IP_http}",
          "--port", "${NOMAD_PORT_http}",
          "--membership", "consul://${attr.unique.network.ip-address}:8500",
          "--node-id", "cache-${NOMAD_ALLOC_INDEX}",
          "--zone", "${node.datacenter}"
        ]
      }

      template {
        destination          = "secrets/cluster.env"
        env                  = true
        error_on_missing_key = true # no cluster_token in the variable: the task does not start (never a "<no value>" token)
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_CLUSTER_TOKEN={{ .cluster_token }}{{ end }}
          {{ with nomadVar "nomad/jobs/switchboard" }}{{ range $k, $v := . }}{{ if eq $k "metrics_token" }}SWITCHBOARD_METRICS_TOKEN={{ $v }}{{ end }}{{ end }}{{ end }}
        EOT
      }

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }

  group "shard" {
    # one datacenter (zone) losing everything must not take every replica with it
    spread {
      attribute = "${node.datacenter}"
    }

    count = 1

    # The autoscaler moves `count` within these bounds (Nomad refuses a scale request outside
    # them); `enabled = false` keeps the Nomad Autoscaler, if you run one, out of the way.
    scaling {
      enabled = false
      min     = 1
      max     = 8
    }

    network {
      port "http" {}
    }

    service {
      name     = "switchboard-shard"
      port     = "http"
      provider = "consul"
      meta {
        url          = "http://${NOMAD_ADDR_http}"
        engine       = "${var.shard_engine}"
        max_num_seqs = "${var.shard_max_num_seqs}"
        pipeline_parallel_size = "${var.shard_pipeline_parallel_size}"
        zone         = "${node.datacenter}"
        keepalive_s  = "0.5"
      }
      check {
        type     = "http"
        path     = "/health" # 503 until the model is loaded: no traffic before that
        interval = "2s"
        timeout  = "1s"
      }
    }

    # scale-down: deregistered from Consul, gateways stop routing here, then SIGTERM; the shard
    # stops admitting and finishes what it runs within kill_timeout
    shutdown_delay = "5s"

    task "shard" {
      driver       = "docker"
      kill_signal  = "SIGTERM"
      kill_timeout = "60s"

      config {
        image        = var.image
        network_mode = "host"
        command      = "switchboard"
        args = [
          "shard",
          "--host", "${NOMAD_IP_http}",
          "--port", "${NOMAD_PORT_http}",
          "--engine", "${var.shard_engine}",
          "--max-num-seqs", "${var.shard_max_num_seqs}",
          "--pipeline-parallel-size", "${var.shard_pipeline_parallel_size}",
          "--pipeline-exit-linger-s", "16",
          "--threads", "${var.shard_threads_per_stage}",
          "--zone", "${node.datacenter}"
        ]
      }

      template {
        destination          = "secrets/cluster.env"
        env                  = true
        error_on_missing_key = true # no cluster_token in the variable: the task does not start (never a "<no value>" token)
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_CLUSTER_TOKEN={{ .cluster_token }}{{ end }}
          {{ with nomadVar "nomad/jobs/switchboard" }}{{ range $k, $v := . }}{{ if eq $k "metrics_token" }}SWITCHBOARD_METRICS_TOKEN={{ $v }}{{ end }}{{ end }}{{ end }}
        EOT
      }

      resources {
        # a whole pipeline group: N stage processes, each --threads cores and ~weights/N + KV/N + 0.8 GiB
        cpu    = 1000 * var.shard_threads_per_stage * var.shard_pipeline_parallel_size
        memory = 1536 + 1536 * var.shard_pipeline_parallel_size
      }
    }
  }
}
